(define (problem plan_trial_T20261122_200001_000001)
    (:domain alfred)
    (:objects
        agent1 - agent
        AppleType - otype
        CabinetType - rtype
        DiningTableType - rtype
        Apple_bar__plus_00_dot_93_bar__plus_00_dot_82_bar__plus_00_dot_30 - object
        Cabinet_bar__minus_01_dot_55_bar__plus_00_dot_40_bar__minus_01_dot_10 - receptacle
        Cabinet_bar__minus_01_dot_55_bar__plus_00_dot_40_bar__minus_00_dot_30 - receptacle
        DiningTable_bar__plus_01_dot_00_bar__plus_00_dot_00_bar__plus_00_dot_40 - receptacle
        loc_bar__minus_4_bar__minus_4_bar_3_bar_45 - location
        loc_bar__minus_4_bar__minus_1_bar_3_bar_45 - location
        loc_bar_3_bar_1_bar_1_bar_60 - location
        loc_bar_0_bar_0_bar_3_bar_30 - location
        )
    (:init
        (receptacleType Cabinet_bar__minus_01_dot_55_bar__plus_00_dot_40_bar__minus_01_dot_10 CabinetType)
        (receptacleType Cabinet_bar__minus_01_dot_55_bar__plus_00_dot_40_bar__minus_00_dot_30 CabinetType)
        (receptacleType DiningTable_bar__plus_01_dot_00_bar__plus_00_dot_00_bar__plus_00_dot_40 DiningTableType)
        (objectType Apple_bar__plus_00_dot_93_bar__plus_00_dot_82_bar__plus_00_dot_30 AppleType)
        (canContain CabinetType AppleType)
        (canContain DiningTableType AppleType)
        (openable Cabinet_bar__minus_01_dot_55_bar__plus_00_dot_40_bar__minus_01_dot_10)
        (openable Cabinet_bar__minus_01_dot_55_bar__plus_00_dot_40_bar__minus_00_dot_30)
        (pickupable Apple_bar__plus_00_dot_93_bar__plus_00_dot_82_bar__plus_00_dot_30)
        (atLocation agent1 loc_bar_0_bar_0_bar_3_bar_30)
        (receptacleAtLocation Cabinet_bar__minus_01_dot_55_bar__plus_00_dot_40_bar__minus_01_dot_10 loc_bar__minus_4_bar__minus_4_bar_3_bar_45)
        (receptacleAtLocation Cabinet_bar__minus_01_dot_55_bar__plus_00_dot_40_bar__minus_00_dot_30 loc_bar__minus_4_bar__minus_1_bar_3_bar_45)
        (receptacleAtLocation DiningTable_bar__plus_01_dot_00_bar__plus_00_dot_00_bar__plus_00_dot_40 loc_bar_3_bar_1_bar_1_bar_60)
        (inReceptacle Apple_bar__plus_00_dot_93_bar__plus_00_dot_82_bar__plus_00_dot_30 DiningTable_bar__plus_01_dot_00_bar__plus_00_dot_00_bar__plus_00_dot_40)
        (objectAtLocation Apple_bar__plus_00_dot_93_bar__plus_00_dot_82_bar__plus_00_dot_30 loc_bar_3_bar_1_bar_1_bar_60)
        )
    (:goal
        (and
            (exists (?r - receptacle)
                (exists (?o - object)
                    (and
                        (inReceptacle ?o ?r)
                        (objectType ?o AppleType)
                        (receptacleType ?r CabinetType)
                    )
                )
            )
        )
    )
)
